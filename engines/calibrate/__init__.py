"""GPU calibration: measure a model's step times on real hardware and fit them into a simulator cost
profile.
"""
