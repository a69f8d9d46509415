"""Tools on top of everything: the command line, the demo, the local launcher, built-in models."""
