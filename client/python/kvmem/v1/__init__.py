"""Stubs generated from proto/kvmem/v1/kvmem.proto at build time (setup.py); not committed."""
