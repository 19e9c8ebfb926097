"""The gVisor backend: every sandbox a ``runsc`` container, with boot images for cold creates."""
