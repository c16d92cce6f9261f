"""Shared test helpers: tiny checkpoints of every family, servers on real ports, the checks many tests make.

Test modules import from here (`from support.checkpoints import make_checkpoint`); no test module imports
another test module.
"""
