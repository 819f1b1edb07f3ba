"""How ranks run together: the step counts every rank agrees on (``align``), how one rank fits its groups to them
(``fitting``) and how ranks pair their groups in a step (``pairing``: one class per ``balance`` criterion)."""
