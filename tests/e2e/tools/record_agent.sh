#!/bin/sh
# Stands in for sandgate-agent (node.agent_path) in tests: the test server on the agent's port, so a test can
# read (GET /seen) what reached the SDK route's backend. Called as the agent is: record_agent.sh --listen ADDR:PORT
exec /usr/bin/python3 "$(dirname "$0")/testserver.py" http "${2##*:}" agent
