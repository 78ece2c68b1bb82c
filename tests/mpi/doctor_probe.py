"""The ``%hvd doctor`` probe on N ranks (tests/test_doctor.py runs it under mpiexec)."""
import sys

from hvd_magic.runner.doctor_probe import main

sys.exit(main())
