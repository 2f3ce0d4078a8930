"""What requests bring besides text: images (images.py), read and checked without torch."""
