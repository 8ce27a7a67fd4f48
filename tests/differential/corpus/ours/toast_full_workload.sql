-- OURS: workload for toast_full.sql
INSERT INTO full_toast SELECT g, (SELECT string_agg(md5(g || '.' || i), '') FROM generate_series(1, 700) i), jsonb_build_object('g', g, 'big', (SELECT string_agg(md5(i || '/' || g), '') FROM generate_series(1, 300) i)), decode((SELECT string_agg(md5(i || ':' || g), '') FROM generate_series(1, 500) i), 'hex') FROM generate_series(21, 60) g;

UPDATE full_toast SET a = a + 1000 WHERE a % 3 = 0;

UPDATE full_toast SET big = big || 'tail' WHERE a % 4 = 0;

UPDATE full_toast SET big = big, doc = doc, blob = blob WHERE a < 5;

DELETE FROM full_toast WHERE a % 5 = 0;

INSERT INTO no_key SELECT g, repeat('n', 3000) FROM generate_series(1, 400) g;
