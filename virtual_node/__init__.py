"""kubestrata virtual node: one lower cluster as one Node of the upper cluster."""
