"""The kubelet API served by a virtual node."""
