"""The sections of the results page and the README's generated blocks, one module per kind of experiment;
``results/make.py`` puts them together."""
