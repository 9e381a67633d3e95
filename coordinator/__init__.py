"""fleetgate coordinator."""
