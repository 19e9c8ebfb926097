"""HOSTILE on purpose: allocates memory until something stops it."""

hog = []
while True:
    hog.append(bytearray(64 * 1024 * 1024))
