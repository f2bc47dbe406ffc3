"""The command-line programs: geopt (and later gerun, geimport, gedoctor)."""
