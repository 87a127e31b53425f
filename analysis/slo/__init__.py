"""At the user's SLO: goodput per level, each arm's capacity, and the fleet at the peak."""
