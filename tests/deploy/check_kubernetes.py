#!/usr/bin/env python3
"""Checks deploy/kubernetes/*.yaml without a cluster: each parses, and what one object names another has
(a mount's volume, a probe's or Service's named port, a Service's selector, the secrets the header says to
create), and every shell script in a container passes `bash -n`. The fleet's etcd: TLS on every client and
peer URL with certificates required both ways, each flag one that Debian's etcd knows (`etcd --help`, when
it is installed), and the name the nodes check its certificates against is one each member's certificate
carries. Exit 1 with one line per problem."""
import os
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


def etcd_flags():
    """The flags `etcd --help` lists, or None without etcd."""
    if not os.access("/usr/bin/etcd", os.X_OK):
        return None
    r = subprocess.run(["/usr/bin/etcd", "--help"], text=True, capture_output=True)
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", r.stdout + r.stderr, re.M))


def check_etcd_tls(path, docs):
    """The etcd StatefulSet serves TLS only and requires client certificates; the sandgate pods dial it over
    https and check its certificates against a name its members' certificates carry."""
    sets = [d for d in docs if d["kind"] == "StatefulSet" and "etcd" in d["metadata"]["name"]]
    for w in sets:
        spec = w["spec"]["template"]["spec"]
        etcd = [c for c in spec["containers"] if c["name"] == "etcd"]
        if not etcd:
            problems.append(f"{path}: {w['metadata']['name']}: no container named etcd")
            continue
        args = etcd[0].get("args", [])
        where = f"{path}: {w['metadata']['name']}/etcd"
        for a in args:
            flag, _, value = a.partition("=")
            if flag.endswith("-urls") and flag != "--listen-metrics-urls" and "http://" in value:
                problems.append(f"{where}: {flag} is clear text ({value})")
            if flag == "--initial-cluster" and "http://" in value:
                problems.append(f"{where}: --initial-cluster names clear-text peers")
        for required in ("--client-cert-auth", "--peer-client-cert-auth", "--cert-file", "--key-file",
                         "--trusted-ca-file", "--peer-cert-file", "--peer-key-file", "--peer-trusted-ca-file"):
            if not any(a.partition("=")[0] == required for a in args):
                problems.append(f"{where}: {required} is not set")
        known = etcd_flags()
        if known is not None:
            for a in args:
                if a.partition("=")[0] not in known:
                    problems.append(f"{where}: {a.partition('=')[0]} is no flag of this etcd (etcd --help)")
        scripts = " ".join(" ".join(c.get("command", [])) for c in spec.get("initContainers", []))
        names = set(re.findall(r"DNS:([a-z0-9.$()_{}A-Z-]+)", scripts))
        for d in docs:
            if d["kind"] != "DaemonSet":
                continue
            for c in d["spec"]["template"]["spec"].get("initContainers", []):
                script = " ".join(c.get("command", []))
                if "ETCD_ENDPOINTS=" not in script:
                    continue
                if re.search(r'ETCD_ENDPOINTS="http://', script):
                    problems.append(f"{path}: {d['metadata']['name']}/{c['name']}: etcd is dialled in clear text")
                server = re.search(r"ETCD_SERVER_NAME=([a-z0-9.-]+)", script)
                if not server:
                    problems.append(f"{path}: {d['metadata']['name']}/{c['name']}: no ETCD_SERVER_NAME for the Service's address")
                elif server.group(1) not in names:
                    problems.append(f"{path}: {d['metadata']['name']}/{c['name']}: ETCD_SERVER_NAME {server.group(1)} "
                                    f"is not a name the members' certificates carry ({sorted(names)})")


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
        check_etcd_tls(path, docs)
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
