"""Load generation: traffic logs in eight formats driven against the arms at a concurrency sweep, a
rate or recorded timing.
"""
