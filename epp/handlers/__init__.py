"""The ext_proc wire layer. It knows the domain only through ``protocol.RequestDirector``."""
