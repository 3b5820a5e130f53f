"""`fsdpfast watch RUN_DIR --out OUT_ROOT`: publish every checkpoint a training run completes as a
Hugging Face folder, once each, never a partial one (discover: when a framework's save is done;
published: what was published already, from the outputs' manifests; loop: the watcher; events:
what it says; then: --then CMD)."""
