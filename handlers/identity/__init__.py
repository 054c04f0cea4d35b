"""Who may call what, decided from a client certificate's names, purely: agents only the agent
RPCs, and a node bound to the certificate that speaks for it.

Pure: no I/O, no gRPC (``handlers.api.access`` reads the certificate and applies the rules).
"""
