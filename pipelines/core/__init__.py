"""What every command shares: the one runner of a command's ``main()`` (``cli``: parsing, logging, one ``error:``
line, exit codes), logging (``logs``), the ``ADLM_*`` settings (``settings``), the typed config library
(``configlib``, ``pydantic_config``), seeds, offline assets, fault injection (``faults``), work-directory URIs and
filesystems (``storage``), starting Ray (``runtime``) and where a run's work can be placed (``placement``)."""
