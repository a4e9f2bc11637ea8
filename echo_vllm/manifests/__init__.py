"""Checks of deploy/'s Kubernetes manifests, away from any cluster: render (kustomize), checks (topology,
commands, mounts, echo.json through the plugin's own validator), schemas (offline JSON schemas), ray_cluster
(serve.sh's GPU count), cli (`echo-vllm deploy ...`). No vLLM import."""
