"""Host-side isolation: one folder per backend (``bwrap/``, ``gvisor/``) behind ``backend.py``'s
interface, and what both share (cgroups, seccomp, id maps, mount namespaces, egress, the process
model, the guest files)."""
