"""`python -m specproxy.engines.calibrate`: measure on this GPU and write a cost profile."""

from specproxy.engines.calibrate.measure import main

main()
