"""--dtype fp8: block-scaled float8_e4m3fn weights with float32 scale_inv per 128x128 block (docs/usage.md)."""
