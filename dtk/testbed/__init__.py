"""An emulated multi-host network on one machine (root only): network namespaces on a bridge, shaped with tc."""
