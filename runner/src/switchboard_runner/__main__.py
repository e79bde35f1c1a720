import sys

from switchboard_runner.cli import main

sys.exit(main())
