"""The README and the manual under docs/: every code block runs or is marked a fragment, the
generated reference pages match the code, the site builds, and the examples answer bad input
with a 4xx."""
