"""Fault-injection tier: killed ranks, full disks, failing stores, damaged files, slow ranks."""
