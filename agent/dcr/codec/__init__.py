"""The codec: find changed elements, code their locations and values, decode and apply."""
