# The fleet's etcd as a container (deploy/kubernetes/fleet.yaml): Debian's etcd-server package, nothing else.
#
#   docker build -f deploy/container/etcd.Dockerfile -t REGISTRY/sandgate-etcd:TAG .
FROM debian:12-slim
RUN apt-get update -q \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server \
 && rm -rf /var/lib/apt/lists/*
# The package's own unprivileged user; the StatefulSet's init container hands it the data volume.
USER etcd
EXPOSE 2379 2380
ENTRYPOINT ["/usr/bin/etcd"]
