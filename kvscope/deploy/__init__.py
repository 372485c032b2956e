"""The Kubernetes deployment under deploy/kubernetes/, generated from the sources the compose stack runs from.

``python -P -m kvscope.deploy.generate [--check]`` writes the kustomize tree (base, overlays ``cpu`` and
``gpu``, the prometheus-adapter rules): workloads from compose.yaml, compose.gpu.yaml and the Dockerfile
(images, commands, ports, memory limits, the image's user), the gateway's config from deploy/gateway.yaml,
scrape interval and job names from deploy/prometheus.yml, the PrometheusRule from alerts/kvscope.rules.yaml
and the Grafana dashboard ConfigMaps from dashboards/json/. docs/deploy.md is the user's guide.

Reads files only and imports nothing of the project outside kvscope.deploy (a tool beside kvscope.dashboards
in the import-linter layers).
"""
