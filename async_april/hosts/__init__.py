"""The machines a run lands on: Ray placement, network interfaces, CPU pinning."""
