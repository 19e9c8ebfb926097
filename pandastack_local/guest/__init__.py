"""Code that runs inside every sandbox: the agent (pid 1's child, the server's peer) and the
code-context kernel. Standard library only: nothing here may import the host-side package."""
