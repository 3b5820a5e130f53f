"""Stage 4, where bytes come from and go to: source files mapped read-only, the output target
(a staging folder published by one rename), and reading a written safetensors folder back."""
