"""The WAN link emulator as a script: ``python bench/linkemu.py`` runs :mod:`dcr.refit.linkemu`.

The implementation lives in the package (``python -m dcr.refit.linkemu``), where the main job
starts it too; this script keeps the benchmark's command line and output unchanged::

    python bench/linkemu.py --listen 127.0.0.1:9100 --to 127.0.0.1:9000 --mbit 250 --rtt-ms 20
"""

from dcr.refit.linkemu import main

if __name__ == "__main__":
    main()
