"""The default backend: bubblewrap namespaces + seccomp + per-sandbox host uids."""
