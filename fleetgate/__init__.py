"""fleetgate: fleet-wide concurrency gates for model servers, coordinated through Redis."""

__version__ = "0.2.0"
