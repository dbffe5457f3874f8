"""torchrun entry points, configuration, data and tracking."""
