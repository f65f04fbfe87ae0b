#!/bin/sh
# Stands in for sandgate-agent (node.agent_path) in tests: the test server on the agent's port, so a test can
# read (GET /seen) what reached the SDK route's backend. Called as the agent is, inside the sandbox (the node
# bind-mounts it at /.sandgate/agent): record_agent.sh --listen ADDR:PORT. The server is the test image's copy.
exec /usr/bin/python3 /sandgate-tests/testserver.py http "${2##*:}" agent
