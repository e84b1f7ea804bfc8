"""dtk: one recipe, trained under DDP, FSDP or DeepSpeed ZeRO, with resilience and comm under the process group."""
__version__ = "0.1.0"
