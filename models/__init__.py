"""Models built from `hybrid` layers."""
