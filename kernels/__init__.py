"""Update kernels: a Pallas fused AdamW for the device path, a native AdamW for the host path."""
