"""The shared vocabulary at the bottom of ckptlab: policies, units, validators. Imports nothing of ckptlab above it."""
