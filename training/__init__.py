"""Training of the small MiniMax-M3 story model that ships with m3lm (not part of the package)."""
