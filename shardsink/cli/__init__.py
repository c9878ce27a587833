"""The ``shardsink`` command line, one module per command group (see :mod:`shardsink.cli.main`).

==============  =====================================================================
module          commands / role
==============  =====================================================================
``main.py``     the entry point (``shardsink = shardsink.cli.main:main``): the parser
                put together from the command groups, one-line errors, exit codes
``catalog.py``  ``collection create|alter|drop|list``, ``sink create|drop|allow-writes|list``
``data.py``     ``append``, ``peek``, ``tail``, ``status``
``produce.py``  ``produce`` (the desired topic a sink reads)
``stack.py``    ``up`` (the embedded Kafka + S3 stack)
``common.py``   helpers: connection flags, the controller session, row codecs
``util.py``     helpers: schema files, the progress bar
==============  =====================================================================
"""
