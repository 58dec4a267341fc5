from sgraf.cli import entry

entry()
