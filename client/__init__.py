"""fleetgate client."""
