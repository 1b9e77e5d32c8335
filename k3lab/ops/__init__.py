"""Registry entries, one module per component (k3lab.registry.OP_MODULES)."""
