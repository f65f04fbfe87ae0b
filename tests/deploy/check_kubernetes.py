#!/usr/bin/env python3
"""Checks deploy/kubernetes/*.yaml without a cluster: each parses, and what one object names another has
(a mount's volume, a probe's or Service's named port, a Service's selector, the secrets the header says to
create), and every shell script in a container passes `bash -n`. Exit 1 with one line per problem."""
import pathlib
import re
import subprocess
import sys

import yaml

problems = []


def check_pod(path, workload, spec, labels, secrets_documented):
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        volumes[claim["metadata"]["name"]] = claim
    containers = spec.get("initContainers", []) + spec["containers"]
    ports = set()
    for c in spec["containers"]:
        ports |= {p["name"] for p in c.get("ports", []) if "name" in p}
    for c in containers:
        where = f"{path}: {workload['metadata']['name']}/{c['name']}"
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                problems.append(f"{where}: mounts volume {m['name']!r}, which the pod does not declare")
        for probe in ("readinessProbe", "livenessProbe"):
            for kind in ("httpGet", "tcpSocket"):
                port = c.get(probe, {}).get(kind, {}).get("port")
                if isinstance(port, str) and port not in {p.get("name") for p in c.get("ports", [])}:
                    problems.append(f"{where}: {probe} uses port {port!r}, which the container does not name")
        command = c.get("command", [])
        if len(command) >= 3 and command[0].endswith("bash") and command[1].startswith("-c"):
            r = subprocess.run(["bash", "-n"], input=command[2], text=True, capture_output=True)
            if r.returncode != 0:
                problems.append(f"{where}: its script does not parse: {r.stderr.strip()}")
    for v in volumes.values():
        secret = v.get("secret", {}).get("secretName")
        if secret and secret not in secrets_documented:
            problems.append(f"{path}: secret {secret!r} is used but the header does not say how to create it")
    return ports


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    manifests = sorted((root / "deploy" / "kubernetes").glob("*.yaml"))
    if not manifests:
        problems.append(f"no manifests under {root}/deploy/kubernetes")
    for path in manifests:
        text = path.read_text()
        try:
            docs = [d for d in yaml.safe_load_all(text) if d]
        except yaml.YAMLError as e:
            problems.append(f"{path}: {e}")
            continue
        secrets_documented = set(re.findall(r"create secret \w+ ([a-z0-9-]+)", text))
        workloads = [d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment")]
        named_ports = {}
        for w in workloads:
            template = w["spec"]["template"]
            labels = template["metadata"].get("labels", {})
            if w["spec"]["selector"]["matchLabels"].items() - labels.items():
                problems.append(f"{path}: {w['metadata']['name']}: its selector does not match its pods' labels")
            named_ports[w["metadata"]["name"]] = (labels, check_pod(path, w, template["spec"], labels, secrets_documented))
            if w["kind"] == "StatefulSet":
                services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
                if w["spec"]["serviceName"] not in services:
                    problems.append(f"{path}: {w['metadata']['name']}: serviceName {w['spec']['serviceName']!r} is not a Service here")
        for s in (d for d in docs if d["kind"] == "Service"):
            selector = s["spec"].get("selector", {})
            targets = [(labels, ports) for labels, ports in named_ports.values() if selector.items() <= labels.items()]
            if not targets:
                problems.append(f"{path}: Service {s['metadata']['name']} selects no workload's pods")
            for p in s["spec"]["ports"]:
                target = p.get("targetPort")
                if isinstance(target, str) and not any(target in ports for _, ports in targets):
                    problems.append(f"{path}: Service {s['metadata']['name']}: targetPort {target!r} is no port of its pods")
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
