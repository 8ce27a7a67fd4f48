-- OURS (written for this corpus, not vendored): identity columns, issue 16 bug 1. Units are separated by blank
-- lines; in setup.sql-style files every unit runs on the publisher (and, emptied, on both targets).
CREATE TABLE id_always_key (id int GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v text);
CREATE TABLE id_always_nonkey (k text PRIMARY KEY, n bigint GENERATED ALWAYS AS IDENTITY (START 100));
INSERT INTO id_always_key (v) VALUES ('copied 1'), ('copied 2');
INSERT INTO id_always_nonkey (k) VALUES ('copied a');
