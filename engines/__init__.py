"""The engines behind the arms: the vLLM launcher, the vLLM-shaped simulator, its cost profiles and
their GPU calibration.
"""
