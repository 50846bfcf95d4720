"""Scripts the distributed tests launch, one process per rank (not collected by pytest)."""
