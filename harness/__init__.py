"""The local federation: control planes built from the Kubernetes Go modules run as local
processes, kwok nodes, K3s containers, and `kubestrata up / down / kubeconfig`. For
development and the tests only: the components and the image need none of it."""
