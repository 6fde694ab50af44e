"""Several teachers in one distillation call (multi-teacher on-policy distillation, MOPD): each completion routed to
one teacher, in-process or served; one student head for all of them."""
