"""Spin a CPU hot loop forever."""

while True:
    pass
